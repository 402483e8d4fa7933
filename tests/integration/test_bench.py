"""``kvmeta bench`` end to end: a real server, real client processes, the JSON report.

No timing assertions (the machine is shared): only that the report counts what happened.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmeta.bench.core_bench import memory_per_key
from kvmeta.bench.driver import BenchConfig, run_bench
from tests.support import SRC, ServerProcess

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "kvmeta", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _check_sane(report: dict, batch: int) -> None:
    assert report["requests"] > 0
    assert report["key_ops"] == report["requests"] * batch
    assert report["requests_per_s"] > 0
    assert 0 < report["latency_p50_us"] <= report["latency_p99_us"]
    assert report["server_cpu_s"] > 0
    assert report["cpu_us_per_request"] > 0
    assert report["cpu_us_per_key"] * batch == pytest.approx(report["cpu_us_per_request"])


def test_bench_launches_kvmeta_and_reports_json() -> None:
    report = _bench(
        "--launch",
        "memory",
        "--requests",
        "200",
        "--clients",
        "2",
        "--batch",
        "64",
        "--pool-pages",
        "1024",
        "--warmup",
        "0.2",
    )
    _check_sane(report, 64)
    assert report["requests"] >= 200
    assert report["config"]["dialect"] == "s"
    assert report["server_rss_mb"] > 0


def test_bench_drives_a_running_server_by_url_and_pid(
    make_server: Callable[..., ServerProcess],
) -> None:
    server = make_server("--in-memory", "--read-lease", "0")
    cfg = BenchConfig(
        url=server.url,
        server_pid=server.pid,
        batch=128,
        pool_pages=512,
        clients=2,
        requests=120,
        warmup=0.2,
    )
    result = run_bench(cfg)
    _check_sane(result.to_dict(), 128)
    assert result.requests >= 120
    # The pool was prefilled, so every reserve evicted; the server is still healthy.
    reply = server.post("/0/exists", {"keys": ["0" * 64]})
    assert reply.status_code == 200
    assert reply.json() == {"exists": [False]}


def test_bench_without_a_server_is_a_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvmeta", "bench"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    assert "--url" in proc.stderr and "--launch" in proc.stderr


def test_memory_per_key_counts_the_key_and_structures() -> None:
    mem = memory_per_key(5000)
    # A 64-hex key alone is 113 bytes; the pool's structures come on top.
    assert mem["bytes_per_stored_key"] > mem["key_str_bytes"]
