"""``benchmarks/bench_prefix.py``: runs end to end against a launched server on Redis, with
the direct Redis lookups beside the route's (its arrival times: ``kvmeta.bench.pacing``).

No timing assertions (the machine is shared): only that every column was measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import child_env

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


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
