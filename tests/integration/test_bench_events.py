"""``benchmarks/bench_events.py`` end to end: real servers with events off and on, at
saturation and at the paced normal load, a subscriber, the app alone and the publisher alone.

No timing assertions (the machine is shared): only that every part was measured, and that the
normal load was paced at half the capacity the run measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_run_measures_both_loads_and_paces_the_normal_one() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_events.py"), "--duration", "1",
         "--warmup", "0", "--pool-pages", "4096", "--repeat", "1", "--clients", "2",
         "--capacity-seconds", "0.3", "--app-cycles", "300", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    saturation, normal = report["saturation"], report["normal"]
    for phase in (saturation, normal):
        assert [r["events"] for r in phase["runs"]] == [False, True]
        assert all(r["cpu_us_per_request"] > 0 for r in phase["runs"])
        on = phase["runs"][1]
        assert on["batches"] > 0 and on["server"]["kvmeta_events_blocks_total"] > 0
        assert len(phase["cpu"]["pairs"]) == 1
    capacity = saturation["runs"][0]["requests_per_s"]
    assert saturation["rate"] == 0
    assert normal["rate"] == round(capacity / 2)
    for run in normal["runs"]:
        assert run["requests_per_s"] < 0.8 * capacity
    assert report["capacity"]["blocks_per_s"] > 0
    assert report["app"]["on_us"] > 0 and report["app"]["off_us"] > 0
