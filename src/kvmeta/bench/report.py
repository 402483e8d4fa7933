"""Benchmark results as a readable table or JSON, and medians over repeated runs."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = [
    "backend_notes",
    "format_table",
    "median_result",
    "pacing_notes",
    "refusal_notes",
    "to_json",
]

# (label, result field, format)
_COLUMNS = (
    ("dialect", "config.dialect", "{}"),
    ("batch", "config.batch", "{}"),
    ("pool", "config.pool_pages", "{}"),
    ("clients", "config.clients", "{}"),
    ("req/s", "requests_per_s", "{:.0f}"),
    ("key-ops/s", "key_ops_per_s", "{:.0f}"),
    ("p50 us", "latency_p50_us", "{:.0f}"),
    ("p99 us", "latency_p99_us", "{:.0f}"),
    ("cpu us/req", "cpu_us_per_request", "{:.1f}"),
    ("cpu us/key", "cpu_us_per_key", "{:.2f}"),
    ("requests", "requests", "{}"),
    ("refused", "refused_keys", "{:.0f}"),
)
# Shown only when some result has them: --launch redis (or --backend-pid), a durable server.
_OPTIONAL_COLUMNS = (
    ("backend cpu us/req", "backend_cpu_us_per_request", "{:.1f}"),
    ("journal B/req", "journal_bytes_per_request", "{:.1f}"),
)


def _get(result: dict[str, Any], dotted: str) -> Any:
    value: Any = result
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table, one row per result dict (``BenchResult.to_dict()``)."""
    columns = _COLUMNS + tuple(
        c for c in _OPTIONAL_COLUMNS if any(_get(r, c[1]) is not None for r in results)
    )
    rows = [[label for label, _, _ in columns]]
    for result in results:
        row = []
        for _, dotted, fmt in columns:
            value = _get(result, dotted)
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def median_result(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The field-wise median of repeated runs of one configuration (config of the first);
    ``runs_cpu_us_per_request`` keeps every run's value so the spread stays visible."""
    out = dict(runs[0])
    for name, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[name] for r in runs if r.get(name) is not None]
            out[name] = statistics.median(values) if values else None
        elif isinstance(value, dict) and name.endswith("_us_per_request"):
            out[name] = {  # per node: the median of each node's runs
                key: statistics.median(
                    r[name][key] for r in runs if isinstance(r.get(name), dict) and key in r[name]
                )
                for key in value
            }
    out["repeats"] = len(runs)
    out["runs_cpu_us_per_request"] = [r.get("cpu_us_per_request") for r in runs]
    return out


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)


def pacing_notes(results: Sequence[dict[str, Any]]) -> list[str]:
    """A warning per result run at ``--rate`` that served less than asked: the server (or
    the machine) could not keep up, so its requests queued and its latencies are the queue's;
    such a run measured an overload, not the load asked for."""
    notes = []
    for result in results:
        rate = (result.get("config") or {}).get("rate") or 0
        served = result.get("requests_per_s") or 0
        if rate and served < 0.95 * rate:
            notes.append(
                f"WARNING: --rate {rate:g} asked, {served:.0f} requests/s served: the server or "
                "this machine could not keep up, so requests queued and the latencies include "
                "the queue. Lower --rate (or measure capacity without it)."
            )
    return notes


def refusal_notes(results: Sequence[dict[str, Any]]) -> list[str]:
    """One warning per result that had keys refused: such a run timed refusals (every page
    read-leased or reserved), not eviction, and its numbers must not be read as eviction's."""
    notes = []
    for result in results:
        refused = result.get("refused_keys") or 0
        if not refused:
            continue
        cfg = result.get("config", {})
        reserved = result.get("reserved_keys") or 0
        out_of = f" of {reserved:.0f}" if reserved else ""
        if cfg.get("launch"):
            lease_fix = "`--server-arg=--read-lease=0`"
        else:
            lease_fix = "a server started with `--read-lease 0`"
        where = f"pool {cfg.get('pool_pages')}, batch {cfg.get('batch')}"
        notes.append(
            f"WARNING: {refused:.0f}{out_of} measured keys were refused ({where}, "
            f"{cfg.get('clients')} clients): every page was "
            "read-leased or reserved, so this run timed refusals, not eviction. Use "
            f"`--pool-pages 1048576` or {lease_fix} to measure eviction "
            "(benchmarks/README.md, 'Read leases and this workload')."
        )
    return notes


def backend_notes(results: Sequence[dict[str, Any]]) -> list[str]:
    """A line per result whose redis-server CPU came from INFO cpu: the total and, for several
    primaries (a cluster), each one's share, so a skewed shard shows."""
    notes = []
    for result in results:
        nodes = result.get("backend_nodes_cpu_us_per_request")
        total = result.get("backend_cpu_us_per_request")
        if result.get("backend_cpu_source") != "info" or not nodes or total is None:
            continue
        if len(nodes) == 1:
            [node] = nodes
            notes.append(f"redis-server CPU per request (INFO cpu of {node}): {total:.1f} us")
            continue
        shares = ", ".join(f"{node} {cpu:.1f}" for node, cpu in sorted(nodes.items()))
        notes.append(
            f"redis-server CPU per request (INFO cpu of {len(nodes)} primaries): {total:.1f} us "
            f"= {shares}"
        )
    return notes
