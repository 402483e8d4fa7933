"""``benchmarks/bench_prefix.py``: runs end to end against a launched server on Redis, with
the direct Redis lookups beside the route's; and its arrival times are a Poisson process.

No timing assertions (the machine is shared): only that every column was measured.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from tests.support import child_env

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_prefix  # noqa: E402


def test_arrivals_are_random_with_the_asked_mean_rate() -> None:
    gaps = bench_prefix.arrivals(200.0, "seed")
    sample = [gaps() for _ in range(20_000)]
    assert abs(statistics.fmean(sample) - 1 / 200) < 0.0002
    # Exponential gaps: the standard deviation equals the mean (a fixed schedule has none).
    assert abs(statistics.pstdev(sample) - 1 / 200) < 0.0003
    assert len(set(sample[:100])) == 100
    assert bench_prefix.arrivals(0.0, "seed")() == 0.0  # back to back


def test_a_run_on_redis_measures_the_route_and_redis_alone(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_prefix.py"),
            "--launch=redis",
            "--phases=idle",
            "--duration=1",
            "--keys=64",
            "--sequences=2",
            f"--json={out}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    idle = json.loads(out.read_text())["idle"]
    assert idle["calls"] > 50
    direct = idle["redis_direct"]
    assert direct["calls"] > 50
    assert 0 < direct["p50_us"] <= direct["p99_us"]
    assert idle["server_cpu_us_per_call"] > 0 and idle["redis_cpu_us_per_call"] > 0
    assert "redis alone p50/p99 us" in proc.stdout
