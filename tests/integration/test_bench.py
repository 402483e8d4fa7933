"""``kvmeta bench`` end to end: a real server, real client processes, the JSON report.

No timing assertions (the machine is shared): only that the report counts what happened.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvmeta.bench.core_bench import memory_per_key
from kvmeta.bench.driver import BenchConfig, run_bench
from tests.support import SRC, ServerProcess

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> Any:
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
        "0",
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
        warmup=0.0,
    )
    result = run_bench(cfg)
    _check_sane(result.to_dict(), 128)
    assert result.requests >= 120
    # The pool was prefilled, so every reserve evicted; the server is still healthy.
    reply = server.post("/0/exists", {"keys": ["0" * 64]})
    assert reply.status_code == 200
    assert reply.json() == {"exists": [False]}


def test_bench_at_a_rate_serves_that_rate_not_the_capacity() -> None:
    args = ("--launch", "memory", "--clients", "2", "--batch", "16", "--pool-pages", "1024")
    report = _bench(*args, "--rate", "150", "--duration", "1.5", "--warmup", "0")
    _check_sane(report, 16)
    assert report["config"]["rate"] == 150
    # Poisson arrivals at 150/s for 1.5 s: about 225 requests (a standard deviation of 15, 10
    # requests/s: the bounds are 7 and 4 of them away), far below what a closed loop of these
    # small requests serves on any machine.
    assert 75 <= report["requests_per_s"] <= 190


def test_a_rate_sweep_measures_each_load() -> None:
    results = _bench(
        *("sweep", "--sweep", "rate", "--values", "60,240", "--launch", "memory"),
        *("--duration", "1.5", "--warmup", "0", "--clients", "2", "--batch", "16"),
        *("--pool-pages", "1024"),
    )
    assert [r["config"]["rate"] for r in results] == [60, 240]
    low, high = (r["requests_per_s"] for r in results)
    # Poisson counts over 1.5 s: 90 and 360 requests expected (standard deviations 9.5 and 19,
    # 6 and 13 requests/s: each bound is over 4.5 of them away).
    assert 30 <= low <= 90 and 150 <= high <= 320


def test_bench_at_a_rate_it_cannot_keep_up_with_says_so() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvmeta", "bench", "--launch", "memory", "--rate", "1000000",
         "--requests", "100", "--clients", "1", "--pool-pages", "1024", "--warmup", "0"],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--rate 1e+06 asked" in proc.stdout and "could not keep up" in proc.stdout


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "fast"])
def test_bench_rejects_a_rate_that_is_not_requests_per_second(value: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvmeta", "bench", "--launch", "memory", "--rate", value],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    assert "--rate" in proc.stderr


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
    # The hash index holds one int per key (an int object alone is 32 bytes or more).
    assert mem["hash_index_bytes_per_key"] > 32


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_bench_launches_redis_and_workers_and_reports_redis_cpu(transport: str) -> None:
    report = _bench(
        *("--launch", "redis", "--workers", "2", "--redis-transport", transport),
        *("--requests", "200", "--clients", "2", "--pool-pages", "1024", "--warmup", "0"),
    )
    _check_sane(report, 64)
    assert report["config"]["launch"] == "redis"
    assert report["config"]["workers"] == 2
    assert report["config"]["redis_transport"] == transport
    # redis-server ran the pool's scripts: its own CPU, apart from kvmeta's.
    assert report["backend_cpu_s"] > 0
    assert report["backend_cpu_us_per_request"] > 0
    assert report["refused_keys"] == 0


def test_bench_reports_journal_bytes_per_request_of_a_durable_server() -> None:
    common = ("--requests", "300", "--clients", "1", "--pool-pages", "512", "--warmup", "0")
    durable = _bench("--launch", "durable", "--server-arg=--fsync=always", *common)
    _check_sane(durable, 64)
    # Every confirm journals 64 (key, page) pairs: at least a hex key's 32 bytes and its
    # 4-byte page per pair (journal format 4) over the cycle's four requests.
    assert durable["journal_bytes_per_request"] >= 64 * (32 + 4) / 4
    memory = _bench("--launch", "memory", *common)
    assert memory["journal_bytes_per_request"] is None
    assert memory["backend_cpu_us_per_request"] is None


def test_bench_sends_the_auth_token(make_server: Callable[..., ServerProcess]) -> None:
    server = make_server("--in-memory", "--read-lease", "0", "--auth-token", "s3cret")
    common = ("--url", server.url, "--server-pid", str(server.pid), "--clients", "1")
    report = _bench(*common, "--auth-token", "s3cret", "--requests", "300", "--warmup", "0")
    _check_sane(report, 64)
    assert report["config"]["auth_token"] == "(set)"  # the token itself is not in the report
    launched = _bench(
        *("--launch", "memory", "--auth-token", "t", "--requests", "300", "--warmup", "0"),
        *("--pool-pages", "1024"),
    )
    _check_sane(launched, 64)
    assert "--auth-token=***" in launched["config"]["server_args"]  # not the token


def test_bench_without_the_token_is_one_clear_line(
    make_server: Callable[..., ServerProcess],
) -> None:
    server = make_server("--in-memory", "--read-lease", "0", "--auth-token", "s3cret")
    proc = subprocess.run(
        [sys.executable, "-m", "kvmeta", "bench", "--url", server.url, "--requests", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "401" in proc.stderr and "kvmeta bench --auth-token" in proc.stderr


def test_core_measures_the_app_with_the_auth_check() -> None:
    from kvmeta.bench.core_bench import app_us_per_request

    assert app_us_per_request(8, 256, 20, auth_token="t") > 0
