"""Sweeps: one benchmark configuration with one parameter varied, as numbers and a chart.

Every point runs on a fresh server when the sweep launches kvmeta itself (a pool's size is
fixed when it is created), and repeats are taken round-robin over the points, so a burst of
load from other processes on a shared machine spreads over all points instead of one.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from kvmeta.bench.driver import BenchConfig
from kvmeta.bench.launch import Launch, run_on, with_launch
from kvmeta.bench.report import median_result
from kvmeta.errors import InvalidRequest, MissingExtra

__all__ = ["DEFAULT_VALUES", "require_chart", "run", "values", "write"]

logger = logging.getLogger(__name__)

DEFAULT_VALUES = {
    "pool": [4096, 65536, 262144, 1048576],
    "batch": [64, 128, 256],
    "clients": [1, 2, 3, 4],
    # requests/s in total (``--rate``): CPU per request against load, below this machine's
    # capacity at the default batch
    "rate": [500, 1000, 2000, 3000],
}
_FIELD = {"pool": "pool_pages", "batch": "batch", "clients": "clients", "rate": "rate"}


def values(param: str, text: str | None) -> list[int]:
    """The points of a sweep: ``text`` ("a,b,c") or the defaults of ``param``.

    Raises:
        InvalidRequest: ``text`` is not a list of positive integers.
    """
    if not text:
        return DEFAULT_VALUES[param]
    try:
        points = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        points = []
    if not points or min(points) < 1:
        raise InvalidRequest(
            f"--values must be comma-separated positive integers (e.g. 4096,65536), got {text!r}"
        )
    return points


def require_chart() -> None:
    """Fail before any measuring when the chart ``write`` draws cannot be drawn.

    Raises:
        KvmetaError: matplotlib cannot be imported (it is an optional dependency).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError as exc:
        raise MissingExtra(
            "`kvmeta bench sweep --out` (a chart; or leave out --out and use --json)",
            "bench",
            exc,
            "out",
        ) from None


def run(
    base: BenchConfig,
    param: str,
    text: str | None,
    launch: Launch | None,
    repeat: int,
) -> list[dict[str, Any]]:
    """The median result of each value of ``param`` ("pool", "batch", "clients" or "rate")."""
    points = values(param, text)
    runs: dict[int, list[dict[str, Any]]] = {v: [] for v in points}
    for rep in range(repeat):
        for value in points:
            cfg = copy.deepcopy(base)
            setattr(cfg, _FIELD[param], value)
            if launch is None:
                # An external server keeps its pools: give every point its own rank.
                cfg.rank = base.rank + len(points) * rep + points.index(value)
            result = run_on(cfg, launch)
            cpu = result["cpu_us_per_request"]
            logger.info(
                "%s=%d repeat %d/%d: %s us/request",
                param,
                value,
                rep + 1,
                repeat,
                "-" if cpu is None else f"{cpu:.1f}",
            )
            runs[value].append(result)
    return [with_launch(median_result(runs[value]), launch) for value in points]


def write(results: list[dict[str, Any]], param: str, stem: str) -> None:
    """``stem``.json with every number and ``stem``.png: CPU per request and per key
    (``require_chart`` first: matplotlib is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(stem + ".json", "w") as fh:
        json.dump({"sweep": param, "results": results}, fh, indent=2, sort_keys=True)

    xs = [r["config"][_FIELD[param]] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(xs, [r["cpu_us_per_request"] for r in results], "o-", label="CPU us / request")
    ax1.set_ylabel("server CPU us per request")
    ax1.set_ylim(bottom=0)
    ax2.plot(xs, [r["requests_per_s"] for r in results], "s-", color="tab:green")
    ax2.set_ylabel("requests / s")
    ax2.set_ylim(bottom=0)
    cfg = results[0]["config"]
    for ax in (ax1, ax2):
        ax.set_xlabel(_FIELD[param])
        if param == "pool":
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    fig.suptitle(
        f"kvmeta bench, dialect {cfg['dialect']}: {param} sweep "
        f"(batch {cfg['batch']}, pool {cfg['pool_pages']}, {cfg['clients']} clients; "
        f"median of {results[0].get('repeats', 1)})"
        if param != "pool"
        else f"kvmeta bench, dialect {cfg['dialect']}: pool size sweep (batch {cfg['batch']}, "
        f"{cfg['clients']} clients; median of {results[0].get('repeats', 1)})"
    )
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=100)
    plt.close(fig)
