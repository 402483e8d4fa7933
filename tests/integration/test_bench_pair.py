"""``kvmeta bench pair``: two servers on identical work, round after round.

The statistics are checked in-process on made-up rounds; the command runs for real (the bench
process, the servers it starts, a subscriber). No timing assertions: only that every round was
measured, on both sides, and that the summary is what the rounds say.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmeta.bench.driver import BenchConfig
from kvmeta.bench.pair import PairPlan, Side, order_of, spread, summarise
from kvmeta.bench.subscriber import events_endpoint
from tests.support import child_env

ROOT = Path(__file__).resolve().parents[2]
# Small runs: the point is the shape of the report, not the numbers.
_SMALL = ("--requests", "200", "--clients", "1", "--pool-pages", "1024", "--warmup", "0")


def _bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", "bench", "pair", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        cwd=ROOT,
    )


def _run(cpu: float, backend: float | None = None, rps: float = 1000.0) -> dict[str, Any]:
    return {
        "config": {"pool_pages": 2048, "batch": 64, "clients": 1, "rate": 0.0},
        "cpu_us_per_request": cpu,
        "backend_cpu_us_per_request": backend,
        "requests": 200,
        "requests_per_s": rps,
        "latency_p50_us": 1.0,
        "latency_p99_us": 2.0,
        "journal_bytes_per_request": None,
        "refused_keys": 0,
    }


def test_spread_is_the_median_and_the_extremes() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "values": [3, 1, 2]}
    assert spread([4.0, 1.0, 2.0, 10.0])["median"] == 3.0
    with pytest.raises(ValueError):
        spread([])


def test_abba_flips_every_round_and_ab_never() -> None:
    assert [order_of(i, "abba") for i in range(4)] == [("a", "b"), ("b", "a")] * 2
    assert {order_of(i, "ab") for i in range(4)} == {("a", "b")}


def test_the_summary_is_the_median_of_the_rounds_ratios_not_the_ratio_of_medians() -> None:
    # The machine slows down over the rounds: each round's ratio is 1.1 or so, while the
    # medians of each side alone come from different rounds.
    pairs = [(100.0, 110.0), (200.0, 230.0), (150.0, 160.0), (300.0, 300.0), (120.0, 150.0)]
    raw = [{"a": _run(a, a / 2), "b": _run(b, b / 4)} for a, b in pairs]
    plan = PairPlan(Side("a", "memory"), Side("b", "memory"), rounds=5)
    result = summarise(BenchConfig(requests=200, seed="pair"), plan, raw)

    ratios = [b / a for a, b in pairs]
    assert [r["ratio"] for r in result["rounds"]] == pytest.approx(ratios)
    assert [r["order"] for r in result["rounds"]] == ["AB", "BA", "AB", "BA", "AB"]
    cpu = result["cpu_us_per_request"]
    assert cpu["ratio"]["median"] == pytest.approx(statistics.median(ratios))
    assert cpu["ratio"]["min"] == pytest.approx(1.0) and cpu["ratio"]["max"] == pytest.approx(1.25)
    assert cpu["a"]["median"] == 150.0 and cpu["b"]["median"] == 160.0
    backend = result["backend_cpu_us_per_request"]
    assert backend["ratio"]["median"] == pytest.approx(statistics.median(r / 2 for r in ratios))
    assert [r["backend_ratio"] for r in result["rounds"]] == pytest.approx([r / 2 for r in ratios])


def test_without_a_shared_backend_there_is_no_backend_summary() -> None:
    raw = [{"a": _run(100.0), "b": _run(105.0)}]
    plan = PairPlan(Side("a", "memory"), Side("b", "durable"), rounds=1)
    result = summarise(BenchConfig(requests=200), plan, raw)
    assert result["backend_cpu_us_per_request"] is None
    assert result["rounds"][0]["backend_ratio"] is None


def test_the_events_endpoint_is_read_from_the_flags_a_local_subscriber_can_reach() -> None:
    assert events_endpoint(["--read-lease=0"]) is None
    assert events_endpoint(["--events=tcp://*:5557"]) == "tcp://127.0.0.1:5557"
    assert events_endpoint(["--events", "tcp://127.0.0.1:9"]) == "tcp://127.0.0.1:9"


@pytest.mark.slow
def test_a_pair_of_identical_memory_servers_gives_five_rounds_of_positive_ratios() -> None:
    proc = _bench("--launch", "memory", *_SMALL, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["mode"] == "pair"
    assert result["config"]["rounds"] == 5 and result["config"]["requests"] == 200
    assert result["a"]["launch"] == result["b"]["launch"] == "memory"
    rounds = result["rounds"]
    assert len(rounds) == 5
    assert [r["order"] for r in rounds] == ["AB", "BA", "AB", "BA", "AB"]
    for r in rounds:
        assert r["ratio"] > 0
        for side in ("a", "b"):
            assert r[side]["cpu_us_per_request"] > 0 and r[side]["requests"] >= 200
    cpu = result["cpu_us_per_request"]
    ratios = [r["ratio"] for r in rounds]
    assert cpu["ratio"]["values"] == ratios
    assert cpu["ratio"]["median"] == statistics.median(ratios)
    assert cpu["ratio"]["min"] == min(ratios) and cpu["ratio"]["max"] == max(ratios)
    assert result["backend_cpu_us_per_request"] is None


@pytest.mark.slow
def test_the_text_report_names_both_sides_and_the_median_ratio() -> None:
    proc = _bench("--a-launch", "memory", "--b-launch", "durable", *_SMALL, "--rounds", "2")
    assert proc.returncode == 0, proc.stderr
    assert "A: memory" in proc.stdout and "B: durable" in proc.stdout
    assert "server CPU per request, B/A: median" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("zmq") is None, reason="the events extra")
def test_a_side_with_events_runs_and_its_subscriber_receives_batches() -> None:
    events = "--b-arg=--events=tcp://127.0.0.1:{port}"
    proc = _bench("--launch", "memory", *_SMALL, "--rounds", "2", events, "--subscribe", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["b"]["server_args"][-1] == "--events=tcp://127.0.0.1:{port}"
    for r in result["rounds"]:
        assert "subscriber_batches" not in r["a"]
        assert r["b"]["subscriber_batches"] > 0
        assert r["ratio"] > 0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--url", "http://127.0.0.1:1"), "--url"),
        (("--a-src", "/nonexistent"), "--a-src"),
        (("--subscribe",), "--events"),
        (("--subscribe", "--b-arg=--events=tcp://127.0.0.1:0"), "port 0"),
        (("--workers", "2"), "--workers"),
    ],
)
def test_a_pair_that_cannot_run_is_refused_in_one_line_before_anything_starts(
    args: tuple[str, ...], named: str
) -> None:
    proc = _bench(*args, timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0], proc.stderr
    assert proc.stdout == ""
