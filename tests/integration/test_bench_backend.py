"""``kvmeta bench`` against a server on Redis: redis-server's CPU per request from ``INFO cpu``
of every primary (no pid needed, so it works for a Redis on another machine or a cluster).

No timing assertions (the machine is shared): only that CPU was counted and reported.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from kvmeta.bench.redisstat import RedisCpu, backend_url_of, primaries_of
from kvmeta.bench.report import backend_notes
from tests.redis_support import RedisServer
from tests.support import SRC, ServerProcess

ROOT = Path(__file__).resolve().parents[2]
_COMMON = ("--requests", "200", "--clients", "2", "--pool-pages", "1024", "--warmup", "0")


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvmeta", "bench", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_bench_reads_redis_cpu_from_info_of_the_servers_backend(
    redis_url: str, make_server: Callable[..., ServerProcess]
) -> None:
    """No --backend-pid, no --backend-url: the backend is found in the server's /v1/pools."""
    server = make_server("--backend", redis_url, "--read-lease", "0")
    report = json.loads(_bench("--url", server.url, *_COMMON, "--json").stdout)
    assert report["requests"] >= 200
    assert report["backend_cpu_source"] == "info"
    assert report["backend_cpu_s"] > 0
    assert report["backend_cpu_us_per_request"] > 0
    node = redis_url.removeprefix("redis://")
    assert set(report["backend_nodes_cpu_us_per_request"]) == {node}
    assert report["backend_nodes_cpu_us_per_request"][node] == pytest.approx(
        report["backend_cpu_us_per_request"]
    )


def test_bench_backend_url_flag_prints_redis_cpu(
    redis_url: str, make_server: Callable[..., ServerProcess]
) -> None:
    server = make_server("--backend", redis_url, "--read-lease", "0")
    text = _bench("--url", server.url, "--backend-url", redis_url, *_COMMON).stdout
    match = re.search(r"redis-server CPU per request \(INFO cpu[^)]*\): ([0-9.]+) us", text)
    assert match, text
    assert float(match.group(1)) > 0
    assert "backend cpu us/req" in text  # the table's column, same number


def test_backend_pid_is_preferred_over_info(
    redis_server: RedisServer, redis_url: str, make_server: Callable[..., ServerProcess]
) -> None:
    server = make_server("--backend", redis_url, "--read-lease", "0")
    args = ("--url", server.url, "--backend-pid", str(redis_server.pid), *_COMMON, "--json")
    report = json.loads(_bench(*args).stdout)
    assert report["backend_cpu_source"] == "pid"
    assert report["backend_cpu_us_per_request"] > 0
    assert report["backend_nodes_cpu_us_per_request"] is None


def test_backend_url_of_server_descriptions() -> None:
    assert backend_url_of("redis at redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert backend_url_of("redis cluster at redis+cluster://a:1,b:2") == "redis+cluster://a:1,b:2"
    assert backend_url_of("redis at unix:///tmp/r.sock?db=0") == "unix:///tmp/r.sock?db=0"
    assert backend_url_of("redis at redis://:***@h:1/0") is None  # password not shown
    assert backend_url_of("durable at /var/lib/kvmeta") is None
    assert backend_url_of("memory") is None


def test_an_unusable_backend_url_is_one_clear_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvmeta", "bench", "--launch", "memory", "--backend-url", "x://"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--backend-url" in proc.stderr and "redis://" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_backend_notes_break_cpu_down_per_primary() -> None:
    result = {
        "backend_cpu_source": "info",
        "backend_cpu_us_per_request": 300.0,
        "backend_nodes_cpu_us_per_request": {"h:1": 100.0, "h:2": 150.0, "h:3": 50.0},
    }
    [note] = backend_notes([result])
    assert "3 primaries" in note and "300.0 us" in note
    assert "h:1 100.0" in note and "h:2 150.0" in note and "h:3 50.0" in note
    assert backend_notes([{"backend_cpu_source": "pid", "backend_cpu_us_per_request": 3.0}]) == []


# ---------------------------------------------------------------------------------- a cluster


class _Cluster:
    """Three cluster-enabled primaries (no replicas), slots split evenly, on free ports."""

    def __init__(self) -> None:
        self.nodes: list[RedisServer] = []

    def start(self) -> _Cluster:
        for _ in range(3):
            self.nodes.append(
                RedisServer("--cluster-enabled", "yes", "--cluster-node-timeout", "5000").start()
            )
        # Each node keeps its config file in its own directory (RedisServer's --dir).
        ranges = [(0, 5460), (5461, 10922), (10923, 16383)]
        for node, (lo, hi) in zip(self.nodes, ranges, strict=True):
            with node.client() as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        with self.nodes[0].client() as client:
            for other in self.nodes[1:]:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", other.port)
        deadline = time.monotonic() + 60
        while not self._ok():
            if time.monotonic() > deadline:
                raise RuntimeError("the test cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def _ok(self) -> bool:
        for node in self.nodes:
            with node.client() as client:
                info = client.execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info or "cluster_known_nodes:3" not in info:
                    return False
        return True

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@pytest.fixture
def cluster() -> Iterator[_Cluster]:
    started = _Cluster()
    try:
        yield started.start()
    finally:
        started.close()


def test_info_cpu_is_read_from_every_primary_of_a_cluster(cluster: _Cluster) -> None:
    addresses = {f"127.0.0.1:{n.port}" for n in cluster.nodes}
    seed = cluster.nodes[1]
    # A cluster URL names any of its nodes; a plain redis:// URL to a cluster node is detected.
    assert set(primaries_of(f"redis+cluster://127.0.0.1:{seed.port}")) == addresses
    assert set(primaries_of(f"redis+cluster://127.0.0.1:1,127.0.0.1:{seed.port}")) == addresses
    assert set(primaries_of(f"redis://127.0.0.1:{seed.port}")) == addresses
    cpu = RedisCpu(f"redis+cluster://127.0.0.1:{seed.port}")
    try:
        before = cpu.sample()
        # A client-side workload on every shard: enough commands for each node's INFO cpu
        # (microsecond resolution) to move.
        client = redis.RedisCluster(host="127.0.0.1", port=seed.port)
        try:
            for _ in range(10):
                pipe = client.pipeline()
                for i in range(600):
                    pipe.set(f"key{i}", "v" * 100)
                pipe.execute()
        finally:
            client.close()
        after = cpu.sample()
    finally:
        cpu.close()
    assert set(before) == set(after) == addresses
    for node in addresses:
        assert after[node] > before[node], node
