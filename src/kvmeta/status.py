"""``kvmeta status``: a server's readiness and pools as a table a person reads at a glance.

Returns text and an exit code instead of printing (``cli`` prints): 0 ready, 1 reachable but
not ready, 2 unreachable or refused (wrong token). Scripts may use ``--json``. ``watch``
(``--watch``) redraws the table in place, like ``top``, until Ctrl-C.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TextIO
from urllib.parse import urlsplit

from kvmeta.client.http import HttpTransport
from kvmeta.client.urls import command_line_url, with_scheme
from kvmeta.errors import (
    InvalidRequest,
    KvmetaError,
    ServerError,
    ServerUnavailable,
    Unauthorized,
)

__all__ = [
    "EXIT_NOT_READY",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "format_table",
    "server_url",
    "status",
    "watch",
]

EXIT_OK = 0
EXIT_NOT_READY = 1
EXIT_UNREACHABLE = 2

_BAR = 20
# Cursor home, then clear the screen: each frame replaces the last one on a terminal.
CLEAR = "\x1b[H\x1b[2J"


def server_url(text: str) -> str:
    """``--url`` as typed, ready for ``status`` and ``watch``: ``host:port`` means
    ``http://host:port``; a token in it stays there (the transport sends it).

    Raises:
        InvalidRequest: it is not an http(s) URL with a host; the message shows it with its
            password as ``***``.
    """
    target = command_line_url(text)
    parts = urlsplit(target.url)
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        parts = parts._replace(netloc="")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(
            f"--url must be http://HOST:PORT or https://HOST:PORT of a kvmeta server (a bare "
            f"HOST:PORT means http://), got {target.shown!r}"
        )
    return with_scheme(text)


def status(
    url: str, token: str | None = None, as_json: bool = False, timeout: float = 5.0
) -> tuple[int, str]:
    """(exit code, text to print) for the server at ``url``."""
    http = HttpTransport(url, max_retries=0, timeout=timeout, auth_token=token)
    try:
        try:
            ready: dict[str, Any] = http.get("/ready")
        except ServerError as exc:
            return EXIT_NOT_READY, f"kvmeta at {http.base_url} is NOT READY: {exc}"
        pools = http.get("/v1/pools")
    except Unauthorized as exc:
        return EXIT_UNREACHABLE, f"kvmeta at {http.base_url} refused the request: {exc}"
    except ServerUnavailable as exc:
        return EXIT_UNREACHABLE, str(exc)
    except KvmetaError as exc:
        return EXIT_UNREACHABLE, f"kvmeta at {http.base_url}: unexpected answer: {exc}"
    finally:
        http.close()
    if as_json:
        return EXIT_OK, json.dumps({"ready": ready, **pools}, indent=2)
    return EXIT_OK, format_table(http.base_url, pools)


def _bar(fraction: float, reserved: float) -> str:
    stored = round(fraction * _BAR)
    held = min(_BAR - stored, round(reserved * _BAR))
    return "[" + "#" * stored + "+" * held + "." * (_BAR - stored - held) + "]"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _pool_name(pool: dict[str, Any]) -> str:
    if pool["dialect"] == "v":
        return f"vllm rank {pool['rank']}"
    return f"sglang rank {pool['rank']} {pool['namespace']}"


def format_table(url: str, doc: dict[str, Any]) -> str:
    """The server line, then one row per pool: occupancy bar (# stored, + reserved), hit rate."""
    server = doc.get("server", {})
    lines = [
        f"kvmeta {server.get('version', '?')} at {url}: ready; backend {server.get('backend')}, "
        f"state {server.get('durability')}, auth {'on' if server.get('auth') else 'off'}, "
        f"tls {'on' if server.get('tls') else 'off'}, epoch {server.get('epoch', '-')}"
    ]
    pools = doc.get("pools", [])
    if not pools:
        lines.append("no pools yet (engines create them with initialize)")
        return "\n".join(lines)
    tenants = any(p.get("tenant") for p in pools)
    header = (
        ("TENANT".ljust(17) if tenants else "")
        + f"{'POOL':<28} {'PAGES':>9}  {'OCCUPANCY (#stored +reserved)':<29} "
        f"{'STORED':>9} {'RESERVED':>8} {'HIT RATE':>8} {'EVICTED':>8} {'WARN':<4}"
    )
    lines.append(header)
    for pool in pools:
        n = pool["num_pages"] or 1
        occupancy = pool["stored"] / n
        counters = pool.get("counters", {})
        warn = "SIZE" if pool.get("size_conflicts") else ""
        lines.append(
            (f"{(pool.get('tenant') or '-')[:16]:<16} " if tenants else "")
            + f"{_pool_name(pool):<28} {pool['num_pages']:>9}  "
            f"{_bar(occupancy, pool['reserved'] / n)} {occupancy * 100:5.1f}% "
            f"{pool['stored']:>9} {pool['reserved']:>8} {_pct(pool.get('hit_rate')):>8} "
            f"{counters.get('evictions', 0):>8} {warn:<4}"
        )
    if any(p.get("size_conflicts") for p in pools):
        lines.append(
            "SIZE: an engine re-initialised the pool with another num_pages (two engines on "
            "one pool?); see the server log"
        )
    return "\n".join(lines)


def watch(
    url: str,
    token: str | None,
    interval: float,
    out: TextIO,
    *,
    as_json: bool = False,
    tty: bool | None = None,
    frames: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Print the status every ``interval`` seconds until Ctrl-C (then exit 0) or ``frames``
    frames. On a terminal each frame replaces the last; otherwise (a pipe, a log file) frames
    follow each other, separated by a blank line. A server that stops answering shows its
    error in the frame and is asked again at the next one."""
    tty = out.isatty() if tty is None else tty
    shown = 0
    try:
        while frames is None or shown < frames:
            _, text = status(url, token, as_json, timeout=max(1.0, min(5.0, interval * 5)))
            stamp = time.strftime("%H:%M:%S")
            footer = f"{stamp}  every {interval:g} s; Ctrl-C to quit"
            if tty:
                out.write(f"{CLEAR}{text}\n\n{footer}\n")
            else:
                out.write(f"{text}\n{footer}\n\n")
            out.flush()
            shown += 1
            if frames is None or shown < frames:
                sleep(interval)
    except KeyboardInterrupt:
        if tty:
            out.write("\n")
            out.flush()
    return EXIT_OK
