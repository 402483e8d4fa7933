"""``benchmarks/bench_eviction.py``: a short replay through launched servers of both
policies over two seeds, and its trace reader; ``eviction_cycle.py`` and
``bench_vllm_batches.py`` run short.

No assertion on which policy serves more (a short trace says little): only that every cell
was measured, the summary sums up the seeds, and the trace reader keys blocks by prefix.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import child_env

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_eviction  # noqa: E402


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_a_short_replay_measures_each_policy_for_each_seed() -> None:
    proc = _run("bench_eviction.py", "--requests=150", "--seeds=2", "--pool-shares=0.05", "--json")
    rows = json.loads(proc.stdout)
    assert sorted((r["seed"], r["policy"]) for r in rows) == [
        (1, "lru"),
        (1, "prefix"),
        (2, "lru"),
        (2, "prefix"),
    ]
    for row in rows:
        assert 0 < row["l3_share"] < 1 and 0 <= row["dead_share"] < 1
        assert (row["server_dead"] is None) == (row["policy"] == "lru")
    assert "prefix/lru served: median" in proc.stderr and "2 seeds" in proc.stderr


def test_the_in_process_replay_measures_what_the_servers_do() -> None:
    args = ("--requests=300", "--pool-shares=0.05", "--json")
    served = json.loads(_run("bench_eviction.py", *args).stdout)
    pooled = json.loads(_run("bench_eviction.py", "--in-process", *args).stdout)
    assert [(r["policy"], r["l3_share"], r["dead_share"]) for r in pooled] == [
        (r["policy"], r["l3_share"], r["dead_share"]) for r in served
    ]
    # The share of used pages prefix keeps is the module's, and changes what it serves.
    other = _run("bench_eviction.py", "--in-process", "--hot-share=0.9", "--policies=prefix", *args)
    assert json.loads(other.stdout)[0]["l3_share"] != pooled[1]["l3_share"]


def test_naming_each_reserves_parent_leaves_prefix_fewer_dead_pages() -> None:
    # The released engines send an empty prefix key; one that named the first key's parent
    # would leave no first-new-page-after-a-host-cache-hit without a parent. Through a server
    # and in process alike; LRU is blind to chains and serves exactly the same.
    args = ("--requests=300", "--pool-shares=0.05", "--json")
    plain = json.loads(_run("bench_eviction.py", "--in-process", *args).stdout)
    named = json.loads(_run("bench_eviction.py", "--in-process", "--send-prefix", *args).stdout)
    served = json.loads(_run("bench_eviction.py", "--send-prefix", *args).stdout)
    assert [(r["l3_share"], r["dead_share"]) for r in named] == [
        (r["l3_share"], r["dead_share"]) for r in served
    ]
    lru, prefix = plain
    assert named[0]["l3_share"] == lru["l3_share"]
    assert named[0]["dead_share"] == lru["dead_share"]
    assert named[1]["dead_share"] < prefix["dead_share"]


def test_the_trace_reader_keys_a_block_by_its_prefix(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [{"hash_ids": [1, 2, 3]}, {"hash_ids": [1, 2, 4]}, {"hash_ids": [9, 2, 3]}]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    first, second, third = bench_eviction.read_trace(trace)
    assert second[:2] == first[:2] and second[2] != first[2]  # a shared prefix, then a branch
    # Block 2 after block 9 is not block 2 after block 1 to a prefix cache.
    assert not set(third) & set(first)
    assert len({b for chain in (first, second, third) for b in chain}) == 7


def test_the_cycle_benchmark_measures_every_policy_and_request_kind() -> None:
    proc = _run("eviction_cycle.py", "--rounds=2", "--cycles=20", "--pages=1024")
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["lru", "prefix"]
    for line in lines:
        for kind in ("exists", "reserve", "confirm", "get", "cycle"):
            assert f" {kind} " in line


def test_the_vllm_batch_benchmark_strands_pages_only_per_key() -> None:
    # Scattered reads under prefix eviction: per-key grants strand pages in given-up saves,
    # whole batches none; both rules are measured on the same seeded load.
    args = ("--seconds=60", "--scattered=64", "--json")
    whole, per_key = json.loads(_run("bench_vllm_batches.py", *args).stdout)
    assert (whole["rule"], per_key["rule"]) == ("whole", "per-key")
    assert whole["tasks"] == per_key["tasks"] > 1000
    assert max(whole["stranded"]) == 0 and whole["stored"] == 8192
    assert max(per_key["stranded"]) > 0 and per_key["failed"] > whole["failed"]
