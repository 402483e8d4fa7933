"""``kvmeta bench pair``: two servers measured on the same work, round after round.

A cost difference of a few percent is smaller than what a shared machine's load does to one
run, so one run of A against one run of B can show anything. Here every round starts both
servers fresh, side by side (sharing one redis-server when both use Redis, each in its own
database), and drives first one and then the other with an identical workload: the same seed,
so the same keys, the same request count and the same warm-up. The order alternates
(A,B then B,A: "abba") so a machine that speeds up or slows down during a round favours neither
side. Each round gives the ratio B/A of server CPU per request (from /proc, which other
processes' load does not inflate); the report is the median of those ratios and their
min-max spread, so a reader sees at once whether the difference is larger than the noise.
"""

from __future__ import annotations

import copy
import logging
import re
import statistics
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmeta.bench.driver import BenchConfig, run_bench
from kvmeta.bench.launch import LaunchedServer, RedisServer, free_port, redact_args
from kvmeta.bench.report import pacing_notes, refusal_notes
from kvmeta.bench.subscriber import Subscriber, events_endpoint
from kvmeta.errors import InvalidRequest, KvmetaError

__all__ = ["ORDERS", "PairPlan", "Side", "format_pair", "order_of", "run_pair", "spread"]

logger = logging.getLogger(__name__)

ORDERS = ("abba", "ab")
_PORT = re.compile(r"\{port\}")
# Per-run numbers the report keeps for each side of each round.
_KEPT = (
    "cpu_us_per_request",
    "backend_cpu_us_per_request",
    "requests",
    "requests_per_s",
    "latency_p50_us",
    "latency_p99_us",
    "journal_bytes_per_request",
    "refused_keys",
)


@dataclass
class Side:
    """One server of the pair: launch ``mode`` (durable, memory, redis), extra ``kvmeta
    serve`` flags (``{port}`` in a flag becomes a free port for every start), and the ``src``
    directory its kvmeta is imported from (None: this checkout's)."""

    label: str
    mode: str
    args: list[str] = field(default_factory=list)
    src: str | None = None

    def check(self) -> None:
        """Raises:
        InvalidRequest: ``src`` is not a directory holding a kvmeta package."""
        if self.src is not None and not (Path(self.src) / "kvmeta" / "__init__.py").is_file():
            raise InvalidRequest(
                f"--{self.label}-src {self.src!r} holds no kvmeta package (no "
                f"{Path(self.src) / 'kvmeta' / '__init__.py'}): give the src directory of a "
                "kvmeta checkout, e.g. after `git archive COMMIT src | tar -x -C /tmp/old`: "
                "/tmp/old/src",
                f"{self.label}_src",
            )

    def describe(self) -> dict[str, Any]:
        return {
            "launch": self.mode,
            "server_args": redact_args(self.args),
            "src": str(Path(self.src).resolve()) if self.src else None,
        }


@dataclass
class PairPlan:
    a: Side
    b: Side
    rounds: int = 5
    order: str = "abba"
    # Connect a subscriber that receives every batch to a side started with --events.
    subscribe: bool = False
    workers: int = 1
    redis_transport: str = "tcp"


def order_of(round_index: int, order: str) -> tuple[str, str]:
    """Which side runs first in round ``round_index`` (0-based): "abba" flips every round."""
    if order == "abba" and round_index % 2:
        return ("b", "a")
    return ("a", "b")


def spread(values: Sequence[float]) -> dict[str, Any]:
    """The median of ``values`` and their min and max: how far apart the rounds were matters
    as much as their middle, so both go in the report.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("no values to summarise")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": list(values),
    }


def _with_ports(args: list[str]) -> list[str]:
    return [_PORT.sub(lambda _: str(free_port()), arg) for arg in args]


def _run_side(cfg: BenchConfig, server: LaunchedServer, subscribe: bool) -> dict[str, Any]:
    run = copy.deepcopy(cfg)
    run.url, run.server_pid = server.url, server.pid
    run.backend_pid, run.data_dir = server.backend_pid, server.data_dir
    endpoint = events_endpoint(server.extra) if subscribe else None
    sub = Subscriber(endpoint) if endpoint else None
    try:
        result = run_bench(run).to_dict()
    finally:
        if sub is not None:
            sub.close()
    if sub is not None:
        result["subscriber_batches"] = sub.batches
    return result


def _one_round(cfg: BenchConfig, plan: PairPlan, index: int) -> dict[str, dict[str, Any]]:
    """Both servers started fresh, each side's run in this round's order; the raw results."""
    with ExitStack() as stack:
        shared = None
        if plan.a.mode == plan.b.mode == "redis":
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmeta-pair-"))
            shared = RedisServer(tmp, plan.redis_transport)
            stack.callback(shared.stop)
            shared.start()
        servers = {}
        for db, side in enumerate((plan.a, plan.b)):
            server = LaunchedServer(
                side.mode,
                _with_ports(side.args),
                side.src,
                workers=plan.workers,
                transport=plan.redis_transport,
                shared_redis=shared,
                redis_db=db,
            )
            servers[side.label] = stack.enter_context(server)
        return {
            label: _run_side(cfg, servers[label], plan.subscribe)
            for label in order_of(index, plan.order)
        }


def _ratio(b: float | None, a: float | None, what: str, index: int) -> float:
    if a is None or b is None or a <= 0:
        raise KvmetaError(
            f"round {index + 1}: no {what} for side A (the server's CPU could not be read from "
            "/proc, or it used none): nothing to compare; run on Linux with more --requests"
        )
    return b / a


def summarise(
    cfg: BenchConfig, plan: PairPlan, raw: list[dict[str, dict[str, Any]]]
) -> dict[str, Any]:
    """The report: each round's numbers and B/A, and the median and spread of every series."""
    rounds = []
    for i, both in enumerate(raw):
        row: dict[str, Any] = {"order": "".join(order_of(i, plan.order)).upper()}
        for label in ("a", "b"):
            kept = {k: both[label].get(k) for k in _KEPT}
            if "subscriber_batches" in both[label]:
                kept["subscriber_batches"] = both[label]["subscriber_batches"]
            row[label] = kept
        row["ratio"] = _ratio(
            row["b"]["cpu_us_per_request"], row["a"]["cpu_us_per_request"], "CPU per request", i
        )
        backend = (row["a"]["backend_cpu_us_per_request"], row["b"]["backend_cpu_us_per_request"])
        row["backend_ratio"] = (
            _ratio(backend[1], backend[0], "redis-server CPU per request", i)
            if None not in backend
            else None
        )
        rounds.append(row)

    def series(field_name: str) -> dict[str, Any] | None:
        a = [r["a"][field_name] for r in rounds]
        b = [r["b"][field_name] for r in rounds]
        if None in a or None in b:
            return None
        ratios = [y / x for x, y in zip(a, b, strict=True) if x > 0]
        return {"a": spread(a), "b": spread(b), "ratio": spread(ratios) if ratios else None}

    cpu = series("cpu_us_per_request")
    assert cpu is not None  # every round's ratio was computed above
    cpu["ratio"] = spread([r["ratio"] for r in rounds])
    flat = [both[label] for both in raw for label in ("a", "b")]
    return {
        "mode": "pair",
        "config": {
            "dialect": cfg.dialect,
            "batch": cfg.batch,
            "pool_pages": cfg.pool_pages,
            "clients": cfg.clients,
            "requests": cfg.requests,
            "warmup": cfg.warmup,
            "rate": cfg.rate,
            "prefill": cfg.prefill,
            "seed": cfg.seed,
            "rounds": plan.rounds,
            "order": plan.order,
            "subscribe": plan.subscribe,
            "workers": plan.workers,
        },
        "a": plan.a.describe(),
        "b": plan.b.describe(),
        "rounds": rounds,
        "cpu_us_per_request": cpu,
        "backend_cpu_us_per_request": series("backend_cpu_us_per_request"),
        "requests_per_s": series("requests_per_s"),
        "notes": pacing_notes(flat) + refusal_notes(flat),
    }


def run_pair(cfg: BenchConfig, plan: PairPlan) -> dict[str, Any]:
    """``plan.rounds`` rounds of ``cfg`` on both sides; the report (see ``summarise``).

    Raises:
        InvalidRequest: a side's ``src`` is not a kvmeta source tree.
        KvmetaError: a server did not start, a client failed, or no CPU could be read.
    """
    plan.a.check()
    plan.b.check()
    if not cfg.seed:
        cfg.seed = "pair"
    raw = []
    for i in range(plan.rounds):
        raw.append(_one_round(cfg, plan, i))
        a, b = raw[-1]["a"]["cpu_us_per_request"], raw[-1]["b"]["cpu_us_per_request"]
        logger.info(
            "round %d/%d: A %s, B %s us/request",
            i + 1,
            plan.rounds,
            "-" if a is None else f"{a:.1f}",
            "-" if b is None else f"{b:.1f}",
        )
    return summarise(cfg, plan, raw)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _line(title: str, s: dict[str, Any], unit: str) -> str:
    r = s["ratio"]
    return (
        f"{title}, B/A: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}) over "
        f"{len(r['values'])} rounds; A median {s['a']['median']:.1f} {unit} "
        f"({s['a']['min']:.1f}-{s['a']['max']:.1f}), B median {s['b']['median']:.1f} {unit} "
        f"({s['b']['min']:.1f}-{s['b']['max']:.1f})"
    )


def format_pair(result: dict[str, Any]) -> str:
    """The report as text: what ran, a row per round, then the medians and spreads."""
    cfg = result["config"]
    head = [
        f"kvmeta bench pair: {cfg['rounds']} rounds (order {cfg['order']}), dialect "
        f"{cfg['dialect']}, batch {cfg['batch']}, pool {cfg['pool_pages']}, {cfg['clients']} "
        f"clients, {cfg['requests']} requests per run, seed {cfg['seed']!r} (the same keys "
        "every run)",
    ]
    for label in ("a", "b"):
        side = result[label]
        src = f" (src {side['src']})" if side["src"] else ""
        head.append(f"  {label.upper()}: {side['launch']}{src} {' '.join(side['server_args'])}")
    backend = result["backend_cpu_us_per_request"] is not None
    columns = ["round", "order", "A cpu us/req", "B cpu us/req", "B/A", "A req/s", "B req/s"]
    if backend:
        columns += ["A redis us/req", "B redis us/req", "redis B/A"]
    subscribed = any("subscriber_batches" in r[s] for r in result["rounds"] for s in "ab")
    if subscribed:
        columns += ["A sub batches", "B sub batches"]
    rows = [columns]
    for i, r in enumerate(result["rounds"]):
        row = [
            str(i + 1),
            r["order"],
            _fmt(r["a"]["cpu_us_per_request"], ".1f"),
            _fmt(r["b"]["cpu_us_per_request"], ".1f"),
            _fmt(r["ratio"], ".3f"),
            _fmt(r["a"]["requests_per_s"], ".0f"),
            _fmt(r["b"]["requests_per_s"], ".0f"),
        ]
        if backend:
            row += [
                _fmt(r["a"]["backend_cpu_us_per_request"], ".1f"),
                _fmt(r["b"]["backend_cpu_us_per_request"], ".1f"),
                _fmt(r["backend_ratio"], ".3f"),
            ]
        if subscribed:
            row += [str(r[s].get("subscriber_batches", "-")) for s in "ab"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    table = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    tail = [_line("server CPU per request", result["cpu_us_per_request"], "us")]
    if backend:
        tail.append(
            _line("redis-server CPU per request", result["backend_cpu_us_per_request"], "us")
        )
    return "\n\n".join(["\n".join(head), "\n".join(table), "\n".join(tail), *result["notes"]])
